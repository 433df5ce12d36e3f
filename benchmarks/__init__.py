"""The experiments: benchmarks of lorafleet on one harness, run from the repository root.

    python -m benchmarks NAME [OPTIONS]       (or python -m benchmarks.NAME [OPTIONS])

harness.py       what every bench shares: sizes, load runs, targets, output, a local Ray
targets.toml     every pass/fail target; benches report them, none asserts one
adapters.py      random PEFT adapters for any model's shapes
kernels.py       the multi-LoRA kernels against a per-sequence loop and the base projection
fused.py         a fused projection's LoRA (Phi-3, Phi-4) held split or fused
engine.py        the replica engine in-process: scenarios, ablations, the transformers + PEFT
                 baseline, other model families, tensor parallelism
gpu.py           the engine on one GPU at Llama-3.1-8B's shape (`.ci/gpu` runs it)
gpu_kit.py       what a bare GPU machine lacks for gpu.py and the CUDA tests (`make gpu-kit`)
overhead.py      one workload in-process and over HTTP on the same CPUs
prefix.py        the demo cluster with the prefix cache on and off, 1 and 2 replicas
tenants.py       fair share between two tenants on one replica
suite.py         the demo cluster under every routing/loading variant and scenario
many_adapters.py 16 to 4,096 adapters registered at runtime: tok/s, TTFT, registration
long_prefill.py  a long prompt's prefill against transformers' sdpa: time and memory
gated_delta.py   Gated DeltaNet's layer core against transformers' torch, on a CPU
quant_gemm.py    quantized GEMMs against the dense matmul at Llama-3.1-8B layer shapes
results/         the committed JSON and plots that docs/performance.md shows

Not part of the installed package: `lorafleet bench http`, the load generator a user
points at a server, is (cluster/bench/http.py), and the HTTP benches drive it.
"""
