"""Model parallelism beside ZeRO data parallelism: the rank grid (mesh), and the tensor, pipeline, sequence and
expert parallel parts that use it."""
