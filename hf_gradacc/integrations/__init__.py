"""Integrations with training frameworks that build their own `Trainer`.

Each module here is imported by its framework, never by ``import hf_gradacc``: importing one needs that framework
installed, importing the package does not.

- :mod:`hf_gradacc.integrations.axolotl`: ``GradAccPlugin``, listed under ``plugins:`` in an axolotl YAML.

Example:
    ```yaml
    plugins:
      - hf_gradacc.integrations.axolotl.GradAccPlugin
    ```
"""
