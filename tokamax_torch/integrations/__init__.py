"""Drop-in backends for other libraries.

Each submodule imports its library when it is imported itself, never here, so
``import tokamax_torch`` never needs them:

- ``tokamax_torch.integrations.transformers``: ``"tokamax"`` attention and experts backends for
  Hugging Face transformers (``pip install tokamax-torch[transformers]``).
"""
