/* Minimal stand-ins for the two CUDA runtime types cudnn_graph.h names. Both are opaque pointers in
 * the real header (driver_types.h), so the generated bindings are identical; this keeps the
 * regeneration free of a CUDA toolkit download. */
#pragma once
#include <stddef.h>
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraph_st *cudaGraph_t;
