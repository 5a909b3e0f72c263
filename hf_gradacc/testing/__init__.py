"""What shows that accumulation is exact, apart from the library's core: tiny models and hostile synthetic data
(:mod:`.tiny`), the float64 full-batch reference that shares no code with the trainer (:mod:`.reference`), the
one-step measurement (:mod:`.one_step`), loss curves (:mod:`.loss_curves`) and the benchmark
(:mod:`.benchmark`). The `hf-gradacc` commands and the test suite both use them."""
