"""Fused Triton kernels of the fast decode path: one module per concept, each with a thin
wrapper, its private @triton.jit body, and a plain-torch `*_ref` that defines the semantics."""
