"""Optional bindings of ffpa-attn to other libraries.

* :mod:`ffpa_attn.integrations.transformers`: ``attn_implementation="ffpa"`` for Hugging Face transformers
  (call ``register_ffpa_attention()`` once, then load the model with ``attn_implementation="ffpa"``).

Importing this package imports no third-party library; each binding imports its library lazily.
"""

__all__: list[str] = []
