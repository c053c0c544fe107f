"""(rules to be written)"""
