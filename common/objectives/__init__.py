"""The numpy references of the training objectives (SFT's NLL, DPO, GRPO) both backends are tested against."""
