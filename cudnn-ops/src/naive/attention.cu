// Naive attention kernels (PyTorch math-path SDPA, one op per launch).
