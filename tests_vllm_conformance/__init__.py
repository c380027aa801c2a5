"""Conformance of every vLLM name the project depends on, per supported vLLM release, read from each release's CUDA
wheel: no GPU, no vLLM installed, nothing of the wheel imported.

* :mod:`.names`: the manifest (what the project depends on, as data; per-release facts from
  ``fusion_pass/vllm/releases.py``), written in the entry kinds of :mod:`.entries`;
* :mod:`.wheel`: a wheel read in place, its modules indexed with ``ast``; :mod:`.schemas`: op schemas, from Python
  registrations and from the compiled extensions' bytes;
* :mod:`.fetch`: which releases (``FUSION_PASS_VLLM_RELEASES``) and their wheels (cached under
  ``FUSION_PASS_WHEEL_CACHE``, else downloaded with ``pip download``); :mod:`.project`: the project's own files,
  read without importing it;
* ``test_names.py``: every entry against every release; ``test_checker.py``: a wrong entry of every kind is
  reported; ``test_project.py``: the manifest says what the project's code says.

Run: ``.venv/bin/python -m pytest -q -p no:cacheprovider tests_vllm_conformance``.
"""
