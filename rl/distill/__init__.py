"""Multi-teacher on-policy distillation (OPD): the student samples, teachers score its tokens.

    losses.py    reverse-KL advantages, top-k and full KL, the distillation objective
    teachers.py  the teacher registry, prefetch and switching, each domain's teacher
    trainer.py   the distillation job (configs/opd_tiny.py)
"""
