"""The decoder-only studies' GPU round (issue 14): every part at the GPU size, in one resumable command."""
