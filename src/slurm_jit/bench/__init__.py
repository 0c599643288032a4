"""Benchmarks (``tools/bench``): every figure a ratio of two things measured side by side in the same run.

One module per idea: ``disk`` (the filesystem's limits), ``save`` (JIT save throughput, bytes, memory, against
upstream), ``overhead`` (the agreement's cost per step), ``signal_exit`` (signal to exit against the grace
calculator), ``staggered`` (signals apart, upstream against ours), ``ckpt_check_speed``, ``resume``, ``gpu``,
``report`` (results.json, results.md, the table); ``runs`` starts and watches the real DeepSpeed ranks and
``cli`` puts it together.
"""
