"""flashop inside other libraries. Each submodule registers flashop with one library when imported:

    import flashop.integrations.transformers   # attn_implementation="flashop" in Hugging Face transformers
"""
