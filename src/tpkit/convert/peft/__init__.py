"""PEFT's LoRA adapters and the converter: a wrapped layer converted as its base layer, the adapter following its
split (`adapters`), and the one seam through which PEFT learns about tpkit's layers (`seam`)."""
