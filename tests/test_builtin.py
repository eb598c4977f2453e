"""The built-in model: written once into the cache, safe under concurrent first use."""

import threading

from megastep.builtin import BUILTIN_NAME, builtin_model_dir
from megastep.checkpoint.loader import scan_checkpoint
from megastep.checkpoint.synthetic import preset


def test_builtin_written_once_and_concurrently(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    results, errors = [], []

    def first_use():
        try:
            results.append(builtin_model_dir())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    want = tmp_path / "megastep" / BUILTIN_NAME
    assert results == [want] * 3
    assert sorted(p.name for p in want.parent.iterdir()) == [BUILTIN_NAME]  # no temp dirs left
    scan = scan_checkpoint(want)
    assert scan.cfg == preset("tiny") and scan.all_problems(require_mtp=True) == []
    assert (want / "tokenizer.json").is_file()
    stamp = (want / "config.json").stat().st_mtime_ns
    assert builtin_model_dir() == want and (want / "config.json").stat().st_mtime_ns == stamp
