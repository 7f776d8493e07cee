"""Evaluation: LAMBADA cloze accuracy, WikiText perplexity, GLUE, reports."""
