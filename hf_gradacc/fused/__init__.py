"""The fused LM head: the head applied only where a target counts, in tiles (:mod:`~hf_gradacc.fused.head`), its
weight gradient written into ``.grad`` (:mod:`~hf_gradacc.fused.into_grad`), and the automatic choice
(:mod:`~hf_gradacc.fused.choice`)."""
