"""Attention kernels. Each kernel lives beside its pure-PyTorch reference, which defines the interface."""

from slm_kernels.attention_ref import packed_attention_ref, prefix_suffix_attention_ref, sequence_of_tokens

__all__ = ["packed_attention_ref", "prefix_suffix_attention_ref", "sequence_of_tokens"]
