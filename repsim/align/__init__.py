"""Aligning frozen image and text embedding spaces: GeRA, contrastive alignment alone, and ASIF.

- :mod:`~repsim.align.config`: the alignment config (``configs/gera.yaml``).
- :mod:`~repsim.align.tables`: the embedding tables stage (frozen image and text embeddings).
- :mod:`~repsim.align.pairing`: the seeded pairing and the neighbors among unpaired points.
- :mod:`~repsim.align.train`: neighbor sampling, batches and the alignment method.
- :mod:`~repsim.align.evaluate`: zero-shot and retrieval scores of a shared space.
- :mod:`~repsim.align.asif`: ASIF, the training-free baseline of relative representations.
- :mod:`~repsim.align.alignment`: the align stage, ``align(config)`` and ``align_stage_of(config)``.
"""
