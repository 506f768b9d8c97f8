#!/bin/bash
# Partial credit: the share of the 15 lines that are right, in /logs/verifier/reward.json.
python3 /tests/check_fizzbuzz.py /app/fizzbuzz.py /logs/verifier/reward.json
