from sgl_kernel.ops import reconstruct_indices_from_tree_mask  # noqa: F401
