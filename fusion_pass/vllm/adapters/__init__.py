"""One adapter per vLLM attention backend, all implementing :class:`.base.BackendAdapter`: :mod:`.mla` (every MLA
backend), :mod:`.cpu_attn`, :mod:`.flash_attn`, :mod:`.flashinfer`; found by name through :mod:`.registry`. What the
guard and the compile-time check read of a layer: :mod:`.layer`; a step's rows from host-side metadata:
:mod:`.host_rows`; cached context from a paged cache: :mod:`.paged`. Imports no vLLM at module level."""
