#include <cudnn_graph.h>
