"""Step functions, one optimizer step over one step's micro-batches behind the ``StepFn``
seam: ``spec`` (``StepSpec``, what every step needs), ``select`` (which step a run gets),
``common`` (what they share), ``text`` and ``pipeline`` (the builders)."""
