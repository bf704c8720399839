#!/bin/sh
echo hello > /app/hello.txt
