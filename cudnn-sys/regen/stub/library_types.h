/* Stand-in for CUDA's library_types.h: the one enum cudnn_graph.h uses (cudnnGetProperty). */
#pragma once
typedef enum libraryPropertyType_t { MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL } libraryPropertyType;
