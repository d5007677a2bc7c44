"""lora"""
