"""Attention over a selected set of keys (DeepSeek sparse attention in MLA's absorbed form:
an MQA over the latent cache rows). See docs/glm5.md."""
