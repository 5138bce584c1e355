"""What each API process keeps in memory and shares across its requests: admission from a
local view of quotas, placement, the engine directory, the key cache."""
