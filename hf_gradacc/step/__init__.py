"""The one owner of an optimizer step (:class:`~hf_gradacc.step.engine.StepEngine`) and what it holds: the step in
flight (:mod:`~hf_gradacc.step.window`), the run's plan (:mod:`~hf_gradacc.step.plan`), the non-finite policy
(:mod:`~hf_gradacc.step.nonfinite`) and the interface it uses of the Trainer (:mod:`~hf_gradacc.step.host`)."""
