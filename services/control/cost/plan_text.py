"""A plan as ``spotrl plan`` prints it for people: the recommendation, each term of the bill with
its arithmetic, and the comparison with always-on."""

from __future__ import annotations

from services.control.cost.planner import Plan, workers_text


def format_plan(plan: Plan) -> str:
    r, t, c = plan.rollout, plan.training, plan.currency
    lines = [
        f"rollout pool    {plan.rollout_instances} x {r.instance_type} ({r.gpus} x {r.gpu} each"
        f"{', ' + workers_text(r) if workers_text(r) else ''}), {r.capacity_type}",
        f"training        {t.instance_type} ({t.gpus} x {t.gpu}), on-demand, "
        + ("kept warm between updates" if plan.keep_training_warm else "started for each update"),
        f"update every    {plan.update_seconds / 60:,.1f} min ({plan.updates_per_day:,.1f} updates a day)",
        "",
    ]
    width = max(len(term.name) for term in plan.terms)
    lines += [f"{term.name:<{width}}  {c} {term.amount:>10,.2f}   {term.arithmetic}" for term in plan.terms]
    lines += [
        "",
        f"{'per day':<{width}}  {c} {plan.cost_per_day:>10,.2f}   against {c} {plan.always_on_per_day:,.2f} always-on",
        f"{'saving':<{width}}  {plan.saving:.0%} less than always-on",
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
