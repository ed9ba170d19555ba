"""Integrations with model libraries. Each is imported on demand and imports its library lazily,
so fa4 never depends on them:

    from fa4.integrations.transformers import register_fa4_attention   # Hugging Face
"""
