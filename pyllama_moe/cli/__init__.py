"""The command line: `pyllama-moe` (main) and the verbs that live in their own modules."""
