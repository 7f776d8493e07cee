"""`python -m gpt_compress` == `gptc`."""
from .cli import main

if __name__ == "__main__":
    main()
