"""The registry's store on etcd: the aetcd client and its transactions (`client`), the
replicas' shared view of instances and revisions (`view`), following etcd's watch into that view
(`follow`), each replica's etcd lease and its failure streak (`lease`), load reports written
between replicas (`loads`), and the `Store` on top of them (`store`)."""
