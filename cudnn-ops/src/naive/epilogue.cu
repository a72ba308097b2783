// Matmul epilogue kernels (one op per launch after the cuBLAS GEMM).
