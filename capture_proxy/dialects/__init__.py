"""Agent-facing API dialects, translated to one upstream Chat Completions call and back."""
