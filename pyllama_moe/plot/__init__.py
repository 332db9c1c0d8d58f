"""Pictures of bench results and expert cache profiles (`pyllama-moe plot`, `pyllama-moe profile`)."""
