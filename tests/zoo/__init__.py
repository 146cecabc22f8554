"""The model zoo: real architectures from ``transformers`` config objects under every strategy, every check.

``models.py`` holds the LightningModules (GPT-2, Llama, BERT, ViT, ResNet), ``harness.py`` runs them and names every
failure by model, strategy and check, ``test_zoo.py`` turns each (model, strategy, check) into a test, and
``python -m tests.zoo --out docs/resume-matrix.md`` writes the same results into the docs.
"""
