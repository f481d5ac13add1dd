"""Cache layouts beyond transformers' own: ``per_head`` (each head's kept rows only, for head-adaptive presses) and
``per_head_attention`` (attention over it, behind transformers' attention interface)."""
