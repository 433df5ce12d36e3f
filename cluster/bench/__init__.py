"""`lorafleet bench http`: a user's load generator against a running server (OpenAI API),
as `vllm bench serve` is vLLM's.

http.py   the load: scenarios (adapter popularity, prefixes, turns), arrivals, per-request
          latencies, the server's adapter-load and prefix counters before and after
stats.py  the percentiles and millisecond cells it reports

The experiments (kernels, the engine in-process, the demo cluster under ablations) are not
part of the package: they are `python -m benchmarks ...` in a checkout (benchmarks/).
"""
