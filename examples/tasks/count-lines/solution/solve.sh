#!/bin/sh
wc -l < /app/words.txt > /app/count.txt
