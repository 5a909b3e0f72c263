"""A user's training script written as transformers' examples/pytorch/language-modeling/run_clm.py is: its logging set-up
word for word (root handler on stdout, transformers' verbosity from `get_process_log_level()`), `HfArgumentParser`
over `TrainingArguments`, and `GradAccTrainer` swapped in for `Trainer`. One process or one rank per process
(``RANK`` / ``WORLD_SIZE`` from the launcher); the tests read its stdout / stderr.

``--no_logging_config`` (taken off before the parser) skips the script's `logging` set-up: a script that configured
nothing, where only transformers' own handler prints.

    python tests/distributed/workers/run_clm_style.py --output_dir out --max_steps 1 --log_level info --use_cpu
"""

from __future__ import annotations

import logging
import sys

import transformers
from transformers import HfArgumentParser, TrainingArguments

from hf_gradacc import GradAccTrainer
from hf_gradacc.testing.tiny import ListDataset, PaddingCollator, build_tiny_model, make_samples

logger = logging.getLogger(__name__)


def main() -> None:
    configure = "--no_logging_config" not in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--no_logging_config"]
    (training_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=argv)
    if configure:  # run_clm.py's set-up
        logging.basicConfig(
            format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
            datefmt="%m/%d/%Y %H:%M:%S",
            handlers=[logging.StreamHandler(sys.stdout)],
        )
        if training_args.should_log:
            transformers.utils.logging.set_verbosity_info()
        log_level = training_args.get_process_log_level()
        logger.setLevel(log_level)
        transformers.utils.logging.set_verbosity(log_level)
        transformers.utils.logging.enable_default_handler()
        transformers.utils.logging.enable_explicit_format()
    samples = make_samples("causal_lm", 16, seed=0)
    trainer = GradAccTrainer(
        model=build_tiny_model("causal_lm"),
        args=training_args,
        train_dataset=ListDataset(samples),
        data_collator=PaddingCollator(),
    )
    trainer.train()
    trainer.end()


if __name__ == "__main__":
    main()
