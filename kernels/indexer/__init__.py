"""The lightning indexer of DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): per-token key
scores and a top-k with a fixed tie rule, over a paged key cache. See docs/glm5.md."""
