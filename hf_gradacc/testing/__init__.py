"""What shows that accumulation is exact, apart from the library's core: tiny models and hostile synthetic data
(:mod:`.tiny`), the float64 full-batch reference that shares no code with the trainer (:mod:`.reference`), the
one-step measurement (:mod:`.one_step`), every step of a multi-step run against its own reference (:mod:`.steps`),
TRL's trainers' data and references (:mod:`.trl_steps`) and a problem with a known gradient noise scale
(:mod:`.noise_scale`). The `hf-gradacc` commands (:mod:`hf_gradacc.commands`, where what `hf-gradacc check` and
`hf-gradacc bench` measure and report lives) and the test suite both use them."""
