#!/bin/bash
grep -c a /app/words.txt > /app/count.txt
