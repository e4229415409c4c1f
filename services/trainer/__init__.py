"""trainer: the DFlash drafter, trained with the frozen target's hidden states extracted online."""
