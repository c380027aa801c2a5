"""The project's own stand-in engine: the host of the shared run-time core that the demo, the tests and the
benchmarks use, as vLLM is the other host (:mod:`fusion_pass.vllm.runtime`).

* :mod:`.batch`: :class:`~.batch.BatchSpec` / :class:`~.batch.RequestSpec` and the forward context
  (:func:`~.batch.batch`, :func:`~.batch.current_batch`);
* :mod:`.registry`: ``layer_name`` -> the layer's runtime (``register_layer``; names global to the process), KV
  cache snapshot / restore / clear;
* :mod:`.cache`: what the KV caches share (:class:`~.cache.KVCache`: the batch check, a transaction that rolls
  back) and MLA's per-request cache (:class:`~.cache.RequestCache`);
* :mod:`.paged_cache`: the standard layers' KV cache in pages (:class:`~.paged_cache.PagedCache`);
* :mod:`.mla`, :mod:`.standard`: the MLA and MHA/GQA runtimes (``MLAAttentionImpl``, ``AttentionImpl``);
* :mod:`.attention_call`: one call of the project's attention ops: the core's guard -> row plan -> backend, one
  paged launch of every row (a standard layer's mixed call), or the exact unfused computation.

The engine imports the core (:mod:`fusion_pass.runtime.guard`, ``row_plan``, ``backends``, ``settings``,
``counters``, ``self_check``, ``policy``); the core imports nothing of the engine (``tests/test_architecture.py``).
Its public names are handed on by :mod:`fusion_pass.runtime`.
"""
