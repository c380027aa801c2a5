"""Compile time: the Inductor post-grad pass (:mod:`.graph_pass`), the matcher that finds candidates and refuses
with a reason or rewrites (:mod:`.matcher`), the layout proofs (:mod:`.layout`), graph dumps (:mod:`.debug`) and
the reports vLLM processes wrote (:mod:`.process_reports`). Nothing here imports the run time."""
