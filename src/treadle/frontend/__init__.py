"""The front-end floor: tokenizing, input validation, detokenizing and output assembly."""
