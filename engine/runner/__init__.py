"""The generating model runner: inputs for a scheduled batch, the forward pass, CUDA graphs
and the fused decode step."""
