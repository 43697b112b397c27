"""The decoder-only studies' GPU round: every part at the GPU size, in one resumable command."""
