"""Model definitions: BERT-family encoders with an extractive-QA head, configs, presets, HF loading.

Models here know nothing about parallelism (see ``partitioner/``).
"""
